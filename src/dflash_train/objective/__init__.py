"""The DFlash training objective (docs/design.md#the-objective): anchors, block inputs, the attention mask,
same-position labels and the position-weighted cross-entropy, computed identically on CPU and GPU.
"""
