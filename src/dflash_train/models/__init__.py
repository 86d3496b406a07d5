"""Model code: the DFlash drafter, its config and checkpoints, and the frozen target.

Nothing here knows about training loops, data or decoding (decode/ drives these models).
"""
