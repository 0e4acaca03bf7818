"""ddtree.generate: the speculative loop over Hugging Face targets: requests, samplers, the
target's verify step, the rounds (fixed and budget="auto") and generate / generate_batch.
Imports ddtree.ops, parallel, models and budget."""
from .checks import HYBRID_MODEL_TYPES, MODES, SUPPORTED_MODEL_TYPES
from .loop import calibrate, calibration_run, generate, generate_batch
from .protocols import Drafter, DraftState, Verifier
from .record import record_drafts
from .results import GenerationResult, tokens_per_second
from .verifier import TargetVerifier

__all__ = ["Drafter", "DraftState", "GenerationResult", "HYBRID_MODEL_TYPES", "MODES",
           "SUPPORTED_MODEL_TYPES", "TargetVerifier", "Verifier", "calibrate", "calibration_run",
           "generate",
           "generate_batch", "record_drafts", "tokens_per_second"]
