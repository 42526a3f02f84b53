"""The marker plugins use to implement pagoda's hooks: ``@pagoda.hookimpl``."""

import pluggy

hookimpl = pluggy.HookimplMarker("pagoda")
