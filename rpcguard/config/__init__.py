"""The configuration: YAML and flags into frozen settings, checked key by key; what a reload changes; the downgrades a configuration switches on."""
