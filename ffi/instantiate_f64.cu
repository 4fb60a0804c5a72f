// One translation unit per dtype so that the kernel instantiations compile in parallel.
#include "softmax_launch.cuh"

namespace jax_softmax {
JAX_SOFTMAX_INSTANTIATE(double)
}  // namespace jax_softmax
