"""The daemon's settings: one flat `Settings` object (`_settings`), mapped one-to-one to
``payloadd serve`` flags and ``PAYLOADD_*`` variables, and its optional TOML file
(`_config_file`). Imports the client's public names only."""

__all__: list[str] = []
