// Page advice on read-only source mappings, shared by every device's gather_cast.
//
// madvise is advisory here: a failure costs memory or speed, never correctness, so its result is
// ignored.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace zerofast {

inline uintptr_t page_size() {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return page;
}

inline void advise(const char* begin, int64_t nbytes, int advice, bool whole_pages_only) {
  const uintptr_t page = page_size();
  uintptr_t lo = reinterpret_cast<uintptr_t>(begin);
  uintptr_t hi = lo + static_cast<uintptr_t>(nbytes);
  // Dropping must spare pages shared with a neighbouring range another thread may be reading;
  // reading ahead may cover them.
  lo = whole_pages_only ? (lo + page - 1) / page * page : lo / page * page;
  hi = whole_pages_only ? hi / page * page : (hi + page - 1) / page * page;
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, advice);
}

}  // namespace zerofast
