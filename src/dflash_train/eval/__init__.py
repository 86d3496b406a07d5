"""Speculative decoding and acceptance-length (tau) evaluation."""
