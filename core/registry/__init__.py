"""The plugin machinery: loading plugins, resolving component names, deprecated names."""
