"""`--init-from HF_DIR`: which Hugging Face directories are gpt-oss's, opened for the loader
(formats/mesh_loader.py reads each device's slice from them: formats/hf_weights.py reads them
with `get_slice` and dequantizes MXFP4 on the host).
"""
from __future__ import annotations

from formats.hf_model import is_hf_dir, open_hf
from formats.errors import UserError
from formats.transformers_import import is_transformers_dir


def is_gpt_oss_dir(path) -> bool:
    """A gpt-oss directory, which --init-from streams onto the mesh (another family's directory:
    formats/transformers_import.py)."""
    return is_hf_dir(path) and not is_transformers_dir(path)


def open_for_init(path):
    """(ModelConfig, HFWeights) of an HF directory that --init-from can load without a conversion."""
    cfg, weights = open_hf(path)
    check_moe(cfg, path)
    return cfg, weights


def check_moe(cfg, path) -> None:
    """--init-from a gpt-oss directory: a one-expert one is refused, naming the conversion."""
    if not cfg.is_moe:
        raise UserError(f"--init-from {path}: a one-expert model loads directly only as a MoE; for the dense "
                        f"preset convert it first (`torchlyra import --hf {path} --out CK --dense`)")
