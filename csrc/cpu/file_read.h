// What the CPU kernels that read checkpoint files share: pread of a whole range, I/O errors the
// Python side turns back into OSError, and how many reader threads a batch gets.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

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

// Runs `work` on `nthreads` threads, this one included. The workers pull items from a shared
// counter and keep their own errors, so a thread that cannot be started (a thread limit) only
// leaves its share to the others; every thread started is joined, even if this one throws,
// where an unjoined std::thread would end the process.
template <class Work>
void run_workers(int nthreads, Work&& work) {
  struct Joiner {
    std::vector<std::thread> pool;
    ~Joiner() {
      for (auto& th : pool) th.join();
    }
  } joiner;
  joiner.pool.reserve(nthreads > 1 ? static_cast<size_t>(nthreads - 1) : 0);
  for (int t = 1; t < nthreads; ++t) {
    try {
      joiner.pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
}

// A file descriptor as the kernels pass it to pread, and a read that stays within int64.
inline int checked_fd(int64_t fd, const char* op, int64_t i) {
  TORCH_CHECK(fd <= INT_MAX, op, ": file descriptor ", fd, " of source ", i, " is not an fd");
  return static_cast<int>(fd);
}

inline void check_file_range(int64_t offset, int64_t nbytes, const char* op, int64_t i) {
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset <= std::numeric_limits<int64_t>::max() - nbytes, op,
              ": source ", i, " reads ", nbytes, " bytes at file offset ", offset, ", past any file");
}

}  // namespace zerofast::cpu
