"""The plugin machinery.

- ``plugin_manager``: loads the ``pagoda.plugins`` entry points, checks their API ranges and resolves a
  component name to its factory.
- ``deprecation``: the deprecated names of the plugin API and what keeps each working until its removal.
- ``adapt``: what is done to every component built from a plugin's factory: renamed methods bound under their
  new names, the defaults of the optional Protocol members it lacks.
"""
