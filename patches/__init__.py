"""One module per patch. Each module defines a `Patch` subclass and a module-level `PATCH`.

Installed as `k3patch.patches`; the engine discovers the modules here and knows none by name.
"""
