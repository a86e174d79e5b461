// A storage cut out of a file mapping's storage, as both readers of csrc/load/ make them.
#pragma once

#include <c10/core/Storage.h>

namespace zerofast::load {

inline void release_mapping(void* impl) { c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(impl)); }

// `nbytes` of `base` from `offset`, sharing its memory and keeping it alive (the view holds a
// reference to the mapping's StorageImpl, dropped when the view's data is released).
inline at::Storage view_of(const at::Storage& base, int64_t offset, int64_t nbytes) {
  c10::StorageImpl* impl = base.unsafeGetStorageImpl();
  c10::raw::intrusive_ptr::incref(impl);
  void* data = const_cast<char*>(static_cast<const char*>(base.data())) + offset;
  at::DataPtr ptr(data, impl, &release_mapping, base.device());
  return at::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(ptr), nullptr, false);
}

}  // namespace zerofast::load
