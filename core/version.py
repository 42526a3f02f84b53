__version__ = "0.1.0"

# The version of the plugin contract (the hooks in pagoda.hookspecs, the protocols in pagoda.interfaces, the
# public methods of the base classes plugins subclass). Unstable before 1.0: any 0.x minor version may rename,
# change or remove a name, with no compatibility shim (docs/plugin-api-changelog.md lists every change). A plugin
# declares the range it was tested with in its module attribute PAGODA_PLUGIN_API (for example ">=0.10,<0.11");
# one whose range excludes this version is refused at load.
PLUGIN_API_VERSION = "0.10"
