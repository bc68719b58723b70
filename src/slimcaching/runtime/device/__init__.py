"""The user's side: serving modes (expert offload, split-style client), sampling and the
fallbacks a device records."""
