"""What operators see: Prometheus metrics and their HTTP endpoint, the exporter-toolkit web config, log formatting with the audit record, systemd readiness."""
