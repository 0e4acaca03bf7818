"""ddtree.budget: budget="auto", the cost-aware tree size of each round: calibrated expected gains,
measured cost profiles (and their cache), the AutoBudget policy and its replay on recorded drafts.
Imports ddtree.ops, ddtree.parallel and ddtree.models; the loop that runs it is passed in."""
from .auto import AutoBudget
from .policy_setup import auto_policy
from .calibrate import CyclingBuckets, calibrate
from .calibration import Calibration
from .costs import (CostProfile, build_version, cache_dir, cache_key, cycle_relative_costs,
                    device_name, kept_rows, load_profile, non_decreasing, profile_identity,
                    save_profile, shrink_sizes)
from .memory import remember
from .policy import BUCKETS, FixedBucket, GenerationReport, Policy, RoundReport
from .round_stats import RoundStats, observed_buckets, pack_stats, unpack_stats

__all__ = ["AutoBudget", "BUCKETS", "Calibration", "CostProfile", "CyclingBuckets", "FixedBucket",
           "GenerationReport", "Policy", "RoundReport", "RoundStats", "auto_policy", "cache_dir",
           "build_version", "cache_key", "calibrate", "cycle_relative_costs", "device_name",
           "kept_rows", "load_profile", "non_decreasing", "observed_buckets", "pack_stats",
           "profile_identity", "remember", "save_profile", "shrink_sizes", "unpack_stats"]
