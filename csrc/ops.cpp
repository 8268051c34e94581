// Every peagle op schema, in one place. Backends register their kernels with TORCH_LIBRARY_IMPL in csrc/cpu and
// csrc/cuda; fake (meta) kernels and autograd formulas are registered from Python (peagle/ops).
#include <Python.h>
#include <torch/library.h>

#include "cpu/large_buffers.h"

TORCH_LIBRARY(peagle, m) {
  // COD sampling of training elements (anchor, depth) for a packed row of T positions.
  m.def(
      "cod_sample(Tensor loss_mask, Tensor document_ids, int num_depths, float ratio, float ratio_min, "
      "int? max_anchors, int seed) -> (Tensor anchors, Tensor depths)");
  // Fused gather of drafter inputs for COD elements: real token/hidden at depth 0, mask token/mask_hidden deeper.
  // feats comes first so that generic harnesses (opcheck) that sum the outputs start from a floating tensor.
  m.def(
      "cod_gather(Tensor input_ids, Tensor hidden, Tensor mask_hidden, Tensor anchors, Tensor depths, "
      "int mask_token_id, int? vocab_size=None) -> (Tensor feats, Tensor ids, Tensor position_ids, "
      "Tensor label_index)");
  m.def(
      "cod_gather_backward(Tensor grad_feats, Tensor anchors, Tensor depths, int num_positions) -> "
      "(Tensor grad_hidden, Tensor grad_mask_hidden)");

  // Returns the CPU output blocks kept for reuse (see csrc/cpu/large_buffers.h) to the OS; bytes released.
  m.def("release_cpu_buffers() -> int", &peagle::cpu::release_large_buffers);

  // Attention masks: the P-EAGLE predicate (DESIGN.md) as a dense boolean mask for SDPA/eager attention, and as the
  // block-sparse tensors of a flex-attention BlockMask (per q block: partial kv blocks, then full kv blocks).
  m.def("mask_dense(Tensor anchors, Tensor depths, Tensor document_ids, int? window=None) -> Tensor");
  m.def(
      "mask_block(Tensor anchors, Tensor depths, Tensor document_ids, int block_size=128, int? window=None) -> "
      "(Tensor kv_num_blocks, Tensor kv_indices, Tensor full_kv_num_blocks, Tensor full_kv_indices)");
}

// `import peagle._C` only needs to run the static registrations above and in the backend files.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "peagle C++/CUDA ops (torch.ops.peagle)", -1,
                                      nullptr};
  return PyModule_Create(&module);
}
