"""Certificates and identity: the private CA and CSR signing, key-file rules, TLS contexts and the material in use, peer identity and the allow-list, start-up certificate warnings."""
