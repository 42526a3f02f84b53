"""Built-in spec decode plugins (registered through pagoda's hooks)."""
