"""The model: checkpoint loading, the default model, dtypes, architectures and layers."""
