// Recurrent forward / serving kernels with bf16 state storage (see delta_fwd_launch.cuh).
#include "delta_fwd_launch.cuh"

KDA_INSTANTIATE_LAUNCH_FWD(__nv_bfloat16)
