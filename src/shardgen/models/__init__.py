"""The model: resolved from the config (fetched or found) and what its files say."""
