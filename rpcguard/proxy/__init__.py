"""The I/O layer: listeners and their lifecycle (server), one link per proxied connection (link), its two endpoints and the dialer (endpoint), what a listener's links share (route)."""
