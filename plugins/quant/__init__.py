"""Built-in quant plugins (registered through pagoda's hooks)."""
