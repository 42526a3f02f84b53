"""The ``pagoda generate``, ``plugins`` and ``serve`` commands."""
