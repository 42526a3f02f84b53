__version__ = "0.1.0"

# The version of the plugin contract (the hooks in pagoda.hookspecs, the protocols in pagoda.interfaces, the
# public methods of the base classes plugins subclass). A minor release only adds; a renamed or removed name keeps
# working with a DeprecationWarning until the removal version pagoda.registry.deprecation records for it.
# docs/plugin-api-changelog.md lists every change. A plugin declares the range it supports in its module
# attribute PAGODA_PLUGIN_API (for example ">=1.0,<2").
PLUGIN_API_VERSION = "1.8"
