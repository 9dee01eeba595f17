"""CLI commands beyond the core four (serve, check, plugins, generate): `new-plugin`, and the
progress bar long commands share."""
