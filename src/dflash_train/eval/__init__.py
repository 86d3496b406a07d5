"""Acceptance-length (tau) and speedup evaluation of a drafter over prompt sets."""
