"""Rotary position embeddings (half-split convention, as Llama/Qwen2): the one copy our heads and the lean draft forward use.

A position p rotates each pair (x_j, x_{j+d/2}) by the angle p·inv_freq_j. Rotations compose,
R(a)R(b) = R(a+b), and the score between a query at t and a key at s depends only on t - s:
(R(t)·q)·(R(s)·k) = (R(t-s)·q)·k. Far-memory attention relies on that to place keys anywhere.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(
    positions: torch.Tensor,  # [n] float32 positions (any real values, not only 0..n-1)
    inv_freq: torch.Tensor,  # [head_dim/2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each # [n, head_dim]."""
    angles = torch.outer(positions, inv_freq)  # [n, head_dim/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R(p)·x for every row. states: # [..., n, head_dim]; cos, sin: # [n, head_dim] (or broadcastable)."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin
