// Deferred checks on CUDA: one int64 error record per device (csrc/include/peagle/deferred.h), allocated once (at
// set_deferred_checks(True) for the current device, at a device's first deferred op for the others) and kept for the
// process, so that captured CUDA graphs may hold its address. check_errors() synchronises every device that
// has a record, reads and resets it, and raises the first error with the immediate check's message.
#include "deferred_cuda.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "checks/cuda.h"
#include "checks/deferred.h"
#include "peagle/deferred.h"

namespace peagle {
namespace {

constexpr size_t kRecordBytes = deferred::kRecordSize * sizeof(int64_t);

std::mutex g_mutex;
std::vector<int64_t*> g_records;  // by device; nullptr until allocated

// Caller holds g_mutex. Restores the current device.
int64_t* allocate_locked(int device) {
  if (g_records.size() <= static_cast<size_t>(device)) g_records.resize(device + 1, nullptr);
  if (g_records[device] != nullptr) return g_records[device];
  int previous = 0;
  check_cuda(cudaGetDevice(&previous), "set_deferred_checks");
  check_cuda(cudaSetDevice(device), "set_deferred_checks");
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, kRecordBytes);
  if (err == cudaSuccess) err = cudaMemset(ptr, 0, kRecordBytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  cudaSetDevice(previous);
  check_cuda(err, "set_deferred_checks");
  g_records[device] = static_cast<int64_t*>(ptr);
  return g_records[device];
}

// The current device's record only: a record on every visible device would create a CUDA context (hundreds of MB) on
// each, in every process of a multi-GPU server. Other devices get theirs at their first deferred op outside a capture
// (a graph's warm-up run).
void prepare() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // no usable device: nothing to prepare
    return;
  }
  int device = 0;
  check_cuda(cudaGetDevice(&device), "set_deferred_checks");
  const std::lock_guard<std::mutex> lock(g_mutex);
  allocate_locked(device);
}

void check() {
  std::vector<int64_t*> records;
  {
    const std::lock_guard<std::mutex> lock(g_mutex);
    records = g_records;
  }
  // No record, nothing to read: and no CUDA call, which would fail where a CUDA build runs without a driver.
  if (std::all_of(records.begin(), records.end(), [](const int64_t* r) { return r == nullptr; })) return;
  int previous = 0;
  check_cuda(cudaGetDevice(&previous), "check_errors");
  for (size_t d = 0; d < records.size(); ++d) {
    if (records[d] == nullptr) continue;
    int64_t host[deferred::kRecordSize] = {};
    cudaError_t err = cudaSetDevice(static_cast<int>(d));
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err == cudaSuccess) err = cudaMemcpy(host, records[d], kRecordBytes, cudaMemcpyDeviceToHost);
    if (err == cudaSuccess && host[deferred::kClaimed] != 0) err = cudaMemset(records[d], 0, kRecordBytes);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    cudaSetDevice(previous);
    check_cuda(err, "check_errors");
    if (host[deferred::kClaimed] != 0) raise_deferred_error(host);
  }
}

const bool g_registered = [] {
  register_deferred_backend({&prepare, &check});
  return true;
}();

}  // namespace

namespace {

// Caller holds g_mutex.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "check_errors");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

int64_t* deferred_record_if_available(int device, cudaStream_t stream) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (static_cast<size_t>(device) < g_records.size() && g_records[device] != nullptr) return g_records[device];
  return capturing(stream) ? nullptr : allocate_locked(device);
}

void check_not_capturing(const char* op, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), op);
  TORCH_CHECK(status == cudaStreamCaptureStatusNone, "peagle.", op,
              ": its immediate argument checks read device values on the host, which a CUDA graph capture forbids: "
              "capture it under peagle.ops.deferred_checks() (errors then raise at peagle.ops.check_errors())");
}

int64_t* deferred_record(int device, cudaStream_t stream) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  if (static_cast<size_t>(device) < g_records.size() && g_records[device] != nullptr) return g_records[device];
  TORCH_CHECK(!capturing(stream), "peagle: deferred checks need cuda:", device,
              "'s error record before a CUDA graph capture on it: call peagle.ops.set_deferred_checks(True) (or enter "
              "peagle.ops.deferred_checks()) with that device current, or run the captured ops once before capturing");
  return allocate_locked(device);
}

}  // namespace peagle
