"""The user tools behind the installed commands (pyproject.toml's [project.scripts], docs/commands.md); the
repository's scripts/<name>.py are wrappers of these modules."""
