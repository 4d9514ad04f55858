"""The engine protocol shared by the front and the engines, which never import each other
(DESIGN.md §2: `wire` imports only the standard library, pydantic, `types` and `errors`)."""
