"""The names DeepSpeed gives the entries of its checkpoint files, written once.

Model-states files (``mp_rank_XX_model_states.pt``, per rank at stage 3) and optimizer-states
files (``[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt``) are pickled dicts; the loader, the
plan builders and the optimizer-state builder all read them under these keys.
"""

# Model-states file.
MODULE = "module"
BUFFER_NAMES = "buffer_names"
PARAM_SHAPES = "param_shapes"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
SHARED_PARAMS = "shared_params"
DP_WORLD_SIZE = "dp_world_size"
MP_WORLD_SIZE = "mp_world_size"
PARALLEL_DIMENSIONS = "checkpoint_parallel_dimensions"
PP_DEGREE = "pp_degree"  # in PARALLEL_DIMENSIONS
TP_DEGREE = "tp_degree"  # in PARALLEL_DIMENSIONS
NUM_EXPERTS = "num_experts"  # MoE: experts per MoE layer
UNIVERSAL_INFO = "universal_checkpoint_info"  # AutoTP: patterns and the shards' affine_map
DS_VERSION = "ds_version"
DS_CONFIG = "ds_config"
GLOBAL_STEPS = "global_steps"
STAGE0_OPTIMIZER = "optimizer"  # stage 0: the mixed-precision wrapper's state dict
STAGE0_FP32_GROUPS = "fp32_groups"  # per group, one fp32 master per parameter
STAGE0_FP32_FLAT = "fp32_groups_flat"  # per group, one flat fp32 master

# Optimizer-states file.
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
ZERO_STAGE = "zero_stage"
PARTITION_COUNT = "partition_count"
ZERO12_FLAT = "single_partition_of_fp32_groups"
ZERO3_FLAT = "fp32_flat_groups"
ALIGNMENT_PADDINGS = "param_alignment_paddings"
ZERO12_INNER = "base_optimizer_state"  # the wrapped torch optimizer's state dict (stages 1-2)
ZERO3_INNER = "optimizer_state_dict"  # the same, nested one level deeper (stage 3)
GROUP_PADDINGS = "group_paddings"  # stages 1-2: per group, this rank's share of the end padding
SLICE_MAPPINGS = "param_slice_mappings"  # stages 1-2: per group, name -> fragment_address in this rank

# A torch optimizer's state dict.
STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"


def flat_key(stage: int) -> str:
    """Where the fp32 master partitions sit in ``optimizer_state_dict``."""
    return ZERO3_FLAT if stage == 3 else ZERO12_FLAT


def inner_key(stage: int) -> str:
    """Where the wrapped optimizer's own state dict sits in ``optimizer_state_dict``."""
    return ZERO3_INNER if stage == 3 else ZERO12_INNER
