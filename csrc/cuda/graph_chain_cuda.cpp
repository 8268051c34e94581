// Torch-facing ops of the graph chain (peagle/decode/harness/graphs.py drives them): the tail op captured at the end of
// each depth graph, and the chain's lifetime (instantiate for device launch + upload, launch, destroy). CUDA-only ops,
// so they are defined here with TORCH_LIBRARY_FRAGMENT, like cuda_host_fallbacks (host_fallback.cpp), and not in
// csrc/ops.cpp: a CPU build has no graph chain (graphs.py runs the host loop there). Their one kernel is a catch-all,
// so scripts/check_cuda_build.py counts them as composite ops.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "checks/cuda.h"
#include "graph_chain_kernels.h"

namespace peagle {
namespace {

struct Chain {
  c10::DeviceIndex device;
  std::vector<cudaGraphExec_t> execs;  // depth graphs, then the finalize graph
  at::Tensor table;                    // the device copy of the handles the tail kernels read (kept alive here)
};

struct Registry {
  std::mutex lock;
  std::unordered_map<int64_t, Chain> chains;
  int64_t next_id = 1;
};

constexpr const char* kNotLive =
    " is not a live graph chain (never created by graph_chain_create, or already destroyed)";

Registry& registry() {
  // Never destroyed: at process exit the CUDA context may be gone before static destructors run.
  static Registry* r = new Registry();
  return *r;
}

const char* instantiate_result_name(cudaGraphInstantiateResult result) {
  switch (result) {
    case cudaGraphInstantiateInvalidStructure:
      return "invalid structure";
    case cudaGraphInstantiateNodeOperationNotSupported:
      return "a node kind that device-launched graphs do not allow (only kernel, memcpy, memset and child graph "
             "nodes; capture on one stream, without host callbacks, events or graph memory allocations)";
    case cudaGraphInstantiateMultipleDevicesNotSupported:
      return "nodes on more than one device";
    default:
      return "see the CUDA error";
  }
}

// A CUDA tensor of `dtype`, contiguous, with `numel` elements (any when negative); 1-D unless `any_shape`.
void check_device_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t numel,
                         const char* what, bool any_shape = false) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == dtype && (any_shape || t.dim() == 1) && t.is_contiguous() &&
                  (numel < 0 || t.numel() == numel),
              "peagle.", op, ": expected ", name, " to be ", what, ", got a ", t.scalar_type(), " tensor of shape ",
              t.sizes(), " on ", t.device(), t.is_contiguous() ? "" : " (not contiguous)");
}

void check_execs(const char* op, const at::Tensor& execs) {
  check_device_tensor(op, "execs", execs, at::kLong, -1, "a contiguous 1-D int64 CUDA tensor of graph handles");
  TORCH_CHECK(execs.numel() >= 2, "peagle.", op, ": expected execs to hold at least one depth graph and the finalize ",
              "graph, got ", execs.numel(), " entries");
}

void destroy_execs(const std::vector<cudaGraphExec_t>& execs) {
  for (cudaGraphExec_t exec : execs) cudaGraphExecDestroy(exec);  // best effort: already failing or shutting down
}

// Instantiates `graph` for device launch and uploads it on `stream`; on failure destroys `done` and raises.
cudaGraphExec_t instantiate_for_device_launch(cudaGraph_t graph, size_t index, cudaStream_t stream,
                                              const std::vector<cudaGraphExec_t>& done) {
  cudaGraphInstantiateParams params{};
  params.flags = cudaGraphInstantiateFlagDeviceLaunch | cudaGraphInstantiateFlagUpload;
  params.uploadStream = stream;
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiateWithParams(&exec, graph, &params);
  if (err != cudaSuccess || params.result_out != cudaGraphInstantiateSuccess) {
    cudaGetLastError();  // clear the error, so that later CUDA calls do not report it again
    destroy_execs(done);
    TORCH_CHECK(false, "peagle.graph_chain_create: graphs[", index,
                "] cannot be instantiated for device launch: ", cudaGetErrorString(err), " (",
                instantiate_result_name(params.result_out), ")");
  }
  return exec;
}

int64_t graph_chain_create(at::IntArrayRef graphs, const at::Tensor& execs) {
  const auto count = static_cast<int64_t>(graphs.size());
  TORCH_CHECK(count >= 2, "peagle.graph_chain_create: expected graphs to hold at least one depth graph and the ",
              "finalize graph, got ", count);
  check_execs("graph_chain_create", execs);
  TORCH_CHECK(execs.numel() == count, "peagle.graph_chain_create: expected execs to hold one entry per graph (", count,
              "), got ", execs.numel());
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(graphs[i] != 0, "peagle.graph_chain_create: graphs[", i, "] is a null cudaGraph_t");
  }
  const c10::cuda::CUDAGuard guard(execs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Chain chain{execs.device().index(), {}, execs};
  for (int64_t i = 0; i < count; ++i) {
    chain.execs.push_back(instantiate_for_device_launch(reinterpret_cast<cudaGraph_t>(graphs[i]),
                                                        static_cast<size_t>(i), stream, chain.execs));
  }
  at::Tensor handles = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  for (int64_t i = 0; i < count; ++i) handles.data_ptr<int64_t>()[i] = reinterpret_cast<int64_t>(chain.execs[i]);
  execs.copy_(handles);  // ordered after the uploads on the current stream
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.lock);
  const int64_t id = r.next_id++;
  r.chains.emplace(id, std::move(chain));
  return id;
}

// Copies the chain's first handle and device out of the registry; raises for an id that names no live chain.
std::pair<cudaGraphExec_t, c10::DeviceIndex> find_chain(const char* op, int64_t chain) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.lock);
  const auto it = r.chains.find(chain);
  TORCH_CHECK(it != r.chains.end(), "peagle.", op, ": chain ", chain, kNotLive);
  return {it->second.execs.front(), it->second.device};
}

void graph_chain_launch(int64_t chain) {
  const auto [first, device] = find_chain("graph_chain_launch", chain);
  const c10::cuda::CUDAGuard guard(device);
  check_cuda(cudaGraphLaunch(first, c10::cuda::getCurrentCUDAStream(device)), "graph_chain_launch");
}

void graph_chain_destroy(int64_t chain) {
  Chain removed;
  {
    Registry& r = registry();
    const std::lock_guard<std::mutex> lock(r.lock);
    const auto it = r.chains.find(chain);
    TORCH_CHECK(it != r.chains.end(), "peagle.graph_chain_destroy: chain ", chain, kNotLive);
    removed = std::move(it->second);
    r.chains.erase(it);
  }
  const c10::cuda::CUDAGuard guard(removed.device);
  // A tail launch still pending would find a destroyed handle: wait for every launched round first.
  check_cuda(cudaDeviceSynchronize(), "graph_chain_destroy");
  destroy_execs(removed.execs);
}

void graph_chain_tail(const at::Tensor& go, const at::Tensor& execs, const at::Tensor& status, int64_t depth) {
  constexpr const char* op = "graph_chain_tail";
  check_device_tensor(op, "go", go, at::kInt, 1, "a 1-element int32 CUDA tensor", /*any_shape=*/true);
  check_execs(op, execs);
  check_device_tensor(op, "status", status, at::kInt, cuda::kChainStatusSize, "a 2-element int32 CUDA tensor");
  TORCH_CHECK(go.device() == execs.device() && status.device() == execs.device(), "peagle.", op,
              ": expected go, execs and status on one device, got ", go.device(), ", ", execs.device(), " and ",
              status.device());
  TORCH_CHECK(depth >= 0 && depth < execs.numel() - 1, "peagle.", op, ": expected depth in [0, ", execs.numel() - 1,
              ") (a depth graph of the chain), got ", depth);
  const c10::cuda::CUDAGuard guard(go.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The tail kernel calls the device runtime's graph launch, so CUDA refuses to launch it outside a graph ("operation
  // not supported", seen on an H200): only a capture may record it.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), op);
  TORCH_CHECK(capture == cudaStreamCaptureStatusActive, "peagle.", op,
              ": expected a call under a CUDA graph capture (its kernel launches graphs from the device, which only a "
              "graph may run), got a call on a stream that is not capturing");
  check_cuda(cuda::launch_chain_tail(go.data_ptr<int32_t>(), execs.data_ptr<int64_t>(), execs.numel(), depth,
                                     status.data_ptr<int32_t>(), stream),
             op);
}

// Device graph launch needs the tail kernel built with relocatable device code, and a device with unified addressing.
bool graph_chain_available() {
  int devices = 0;
  if (!cuda::device_graph_launch_compiled() || cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return false;
  }
  int unified = 0;
  const int device = c10::cuda::current_device();
  return cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device) == cudaSuccess && unified != 0;
}

}  // namespace
}  // namespace peagle

TORCH_LIBRARY_FRAGMENT(peagle, m) {
  // True when this build and the current device support device graph launch (else graphs.py runs a host loop).
  m.def("graph_chain_available() -> bool", &peagle::graph_chain_available);
  // Instantiates raw cudaGraph_t handles (depth graphs, then finalize) for device launch, uploads them, writes their
  // exec handles into execs [G] int64 (what the tail kernels read) and returns the chain's id.
  m.def("graph_chain_create(int[] graphs, Tensor(a!) execs) -> int", &peagle::graph_chain_create);
  // Launches the chain's depth 0 graph on the current stream; returns without synchronising.
  m.def("graph_chain_launch(int chain) -> ()", &peagle::graph_chain_launch);
  // Waits for the device, then destroys the chain's executable graphs.
  m.def("graph_chain_destroy(int chain) -> ()", &peagle::graph_chain_destroy);
  // Captured last in depth graph `depth` (raises outside a capture): reads go [1] int32 and tail-launches execs[depth +
  // 1] (go != 0 and another depth exists) or the finalize graph execs[G - 1]; counts launches and records the first
  // failure in status [2].
  m.def("graph_chain_tail(Tensor go, Tensor execs, Tensor(a!) status, int depth) -> ()", &peagle::graph_chain_tail);
}
