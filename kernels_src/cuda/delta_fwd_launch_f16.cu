// Recurrent forward / serving kernels with f16 state storage (see delta_fwd_launch.cuh).
#include "delta_fwd_launch.cuh"

KDA_INSTANTIATE_LAUNCH_FWD(__half)
