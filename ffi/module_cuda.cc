// nanobind module exposing the CUDA handlers as capsules: registrations() -> {target: capsule}.
#include <nanobind/nanobind.h>

#include "softmax_cuda.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule Encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jax_softmax_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_softmax_fwd"] = Encapsulate(JaxSoftmaxFwdCuda);
    d["jax_softmax_bwd"] = Encapsulate(JaxSoftmaxBwdCuda);
    return d;
  });
}
