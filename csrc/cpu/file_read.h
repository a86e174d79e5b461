// What the CPU kernels that read checkpoint files share: pread of a whole range, I/O errors the
// Python side turns back into OSError, and how many reader threads a batch gets.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace zerofast::cpu {

[[noreturn]] inline void io_error(const char* what, int err, int64_t offset, int64_t nbytes) {
  // "[errno N]" lets the Python side turn this back into an OSError (ENOSPC, EFBIG, EIO).
  TORCH_CHECK(false, "zerofast: ", what, " of ", nbytes, " bytes at offset ", offset, " failed: ",
              std::strerror(err), " [errno ", err, "]");
}

inline void pread_all(int fd, char* dst, int64_t nbytes, int64_t offset) {
  while (nbytes > 0) {
    const ssize_t got = ::pread(fd, dst, static_cast<size_t>(nbytes), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) io_error("read", errno, offset, nbytes);
    // The loader checked each storage against the file's size; a file that shrank since is an
    // error here, where a mapping would have died of SIGBUS.
    TORCH_CHECK(got > 0, "zerofast: a checkpoint file ended at offset ", offset,
                " while reading it: it was truncated after it was opened [errno ", EIO, "]");
    dst += got;
    offset += got;
    nbytes -= got;
  }
}

// `readers` <= 0 means torch's intra-op thread count. More readers than cores keeps several
// requests in flight on a cold read; warm, the extra threads mostly wait their turn for a core.
inline int reader_threads(size_t items, int64_t readers) {
  const int64_t n = readers > 0 ? readers : at::get_num_threads();
  return static_cast<int>(std::min<size_t>(static_cast<size_t>(n), std::max<size_t>(items, 1)));
}

}  // namespace zerofast::cpu
