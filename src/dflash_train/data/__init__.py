"""Data: conversation sources, normalisation and the deterministic train / held-out split."""
