// See weight_split_cache.h.
#include "weight_split_cache.h"

#include "op_args.h"

#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
// c10's stream header, not ATen/cuda/CUDAContext.h: that one includes cusparse.h and cublas,
// which a CUDA toolkit without the math libraries (CI's) lacks.
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace epifuse {

// EPIFUSE_STEP_OPERANDS (debug_switches.cu, the one reader of the environment).
bool step_operands_shared();

namespace {

thread_local KeepPolicy keep_policy = KeepPolicy::kRepeated;

}  // namespace

WeightOperandsKept::WeightOperandsKept(KeepPolicy policy) : saved_(keep_policy) {
  keep_policy = policy;
}
WeightOperandsKept::~WeightOperandsKept() { keep_policy = saved_; }
KeepPolicy WeightOperandsKept::policy() { return keep_policy; }

namespace {

// What is kept of a weight: its 3x split (split_fp16), or its cast to a dtype (kCast + the dtype).
constexpr int kSplit = -1;

struct Entry {
  Entry(c10::StorageImpl* impl, const at::Tensor& w, int kind)
      : storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl)),
        offset(w.storage_offset()),
        sizes(w.sizes().vec()),
        strides(w.strides().vec()),
        version(w._version()),
        kind(kind) {}

  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
  uint32_t version;
  int kind;
  KeepPolicy policy = KeepPolicy::kRepeated;  // of the call that made value
  at::Tensor value;  // kRepeated: undefined until two calls in a row saw `version`
  cudaStream_t made_on = nullptr;
  std::shared_ptr<CUevent_st> ready;  // recorded on made_on after value was written
};

std::shared_ptr<CUevent_st> new_event() {
  cudaEvent_t event = nullptr;
  cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  return std::shared_ptr<CUevent_st>(event, [](cudaEvent_t e) {
    if (e != nullptr) cudaEventDestroy(e);
  });
}

// A handful of weights per process; entries whose storage died are dropped on the next lookup.
constexpr size_t kMaxEntries = 16;

bool same_view(const Entry& e, const at::Tensor& w) {
  return e.offset == w.storage_offset() && e.sizes == w.sizes().vec() && e.strides == w.strides().vec();
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

std::mutex& entries_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::vector<Entry>& entries_list() {
  static std::vector<Entry> entries;
  return entries;
}

// The kept operand of kind `kind` for w, made by make() on `stream` when first worth keeping;
// undefined when not kept (kRepeated: first sight, or w written since the last call).
at::Tensor kept(const at::Tensor& w, int kind, cudaStream_t stream,
                const std::function<at::Tensor()>& make) {
  const KeepPolicy policy = WeightOperandsKept::policy();
  // An inference tensor (made under torch.inference_mode) has no version counter to tell whether
  // it was written since: never kept, made at each call.
  if ((policy == KeepPolicy::kStep && !step_operands_shared()) || capturing(stream) ||
      w.is_inference()) {
    return {};
  }
  const std::lock_guard<std::mutex> lock(entries_mutex());
  std::vector<Entry>& entries = entries_list();
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [](const Entry& e) { return e.storage.expired(); }),
                entries.end());
  c10::StorageImpl* storage = w.storage().unsafeGetStorageImpl();
  const uint32_t version = w._version();
  auto it = std::find_if(entries.begin(), entries.end(), [&](const Entry& e) {
    return e.storage._unsafe_get_target() == storage && e.kind == kind && same_view(e, w);
  });
  const bool step = policy == KeepPolicy::kStep;
  if (it == entries.end()) {  // first sight: remember the version (kRepeated: make it in place)
    if (entries.size() == kMaxEntries) entries.erase(entries.begin());
    entries.emplace_back(storage, w, kind);
    if (!step) return {};
    it = entries.end() - 1;
  } else if (it->version != version) {  // written since
    it->version = version;
    it->value = at::Tensor();
    if (!step) return {};  // a weight in training: not worth keeping between calls
  }
  if (!it->value.defined()) {
    it->value = make();
    it->policy = policy;
    it->made_on = stream;
    if (!it->ready) it->ready = new_event();
    cudaEventRecord(it->ready.get(), stream);
  } else if (stream != it->made_on) {
    cudaStreamWaitEvent(stream, it->ready.get(), 0);
    c10::cuda::CUDACachingAllocator::recordStream(
        it->value.storage().data_ptr(),
        c10::cuda::getStreamFromExternal(stream, it->value.device().index()));
  }
  return it->value;
}

}  // namespace

void release_step_operands() {
  const std::lock_guard<std::mutex> lock(entries_mutex());
  for (Entry& e : entries_list()) {
    if (e.policy == KeepPolicy::kStep) e.value = at::Tensor();
  }
}

at::Tensor cached_weight_split(const at::Tensor& w, const GemmProblem& p, cudaStream_t stream) {
  return kept(w, kSplit, stream, [&] {
    at::Tensor split = new_cuda({int64_t(split_weight_bytes(p))}, w.options().dtype(at::kByte));
    split_weight(p, split.data_ptr(), stream);
    return split;
  });
}

at::Tensor kept_weight_cast(const at::Tensor& w, at::ScalarType dtype) {
  if (w.scalar_type() == dtype) return w;
  if (!w.is_cuda()) return w.to(dtype);
  // A traced weight (a FakeTensor or functional wrapper under torch.compile, symbolic sizes with
  // dynamic shapes) has no storage and view to key a kept cast by: cast it as it is.
  if (w.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      w.key_set().has(c10::DispatchKey::Python) ||
      w.key_set().has(c10::DispatchKey::Functionalize)) {
    return to_gemm_dtype(w, dtype);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(w.device().index()).stream();
  at::Tensor cast = kept(w, int(dtype), stream, [&] { return to_gemm_dtype(w, dtype); });
  return cast.defined() ? cast : to_gemm_dtype(w, dtype);
}

}  // namespace epifuse
