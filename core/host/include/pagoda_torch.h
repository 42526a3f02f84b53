// What every pagoda C++ kernel needs from torch to take tensors from Python: at::Tensor and its methods,
// at::parallel_for, and pybind11 with torch's casters for tensors, dtypes and optionals. A kernel that calls an
// ATen function includes that function's own header too (<ATen/ops/empty.h>, ...). <torch/extension.h> would
// bring in every ATen operator, autograd and the C++ frontend's modules: about twice the text, parsed again by
// every kernel build.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
