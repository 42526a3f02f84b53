"""The plugin machinery.

- ``plugin_manager``: loads the ``pagoda.plugins`` entry points, checks their API ranges and resolves a
  component name to its factory.
- ``adapt``: what is done to every component built from a plugin's factory: the defaults of the optional
  Protocol members it lacks.
"""
