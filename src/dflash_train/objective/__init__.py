"""The DFlash training objective (DESIGN §3): anchors, block inputs, the attention mask,
same-position labels and the position-weighted cross-entropy, computed identically on CPU and GPU.
"""
