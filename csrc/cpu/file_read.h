// What the CPU kernels that read checkpoint files share: their sources and the checks of their
// arguments, pread of a whole range, I/O errors the Python side turns back into OSError, and how
// many reader threads a batch gets.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <system_error>
#include <thread>
#include <vector>

#include "../check.h"
#include "../gather_cast_checks.h"

namespace zerofast::cpu {

using Tensor = torch::stable::Tensor;
using IntList = torch::headeronly::HeaderOnlyArrayRef<int64_t>;

[[noreturn]] inline void io_error(const char* what, int err, int64_t offset, int64_t nbytes) {
  // "[errno N]" lets the Python side turn this back into an OSError (ENOSPC, EFBIG, EIO).
  fail("zerofast: ", what, " of ", nbytes, " bytes at offset ", offset, " failed: ", std::strerror(err), " [errno ",
       err, "]");
}

inline void pread_all(int fd, char* dst, int64_t nbytes, int64_t offset) {
  while (nbytes > 0) {
    const ssize_t got = ::pread(fd, dst, static_cast<size_t>(nbytes), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) io_error("read", errno, offset, nbytes);
    // The loader checked each storage against the file's size; a file that shrank since is an
    // error here, where a mapping would have died of SIGBUS.
    ZF_CHECK(got > 0, "zerofast: a checkpoint file ended at offset ", offset,
             " while reading it: it was truncated after it was opened [errno ", EIO, "]");
    dst += got;
    offset += got;
    nbytes -= got;
  }
}

// `readers` <= 0 means torch's intra-op thread count. More readers than cores keeps several
// requests in flight on a cold read; warm, the extra threads mostly wait their turn for a core.
// At most kMaxReaders, whatever is asked: a thread per item of a large batch would only exhaust
// the process's threads and memory.
constexpr int64_t kMaxReaders = 1024;

inline int reader_threads(size_t items, int64_t readers) {
  const int64_t asked = readers > 0 ? readers : static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t n = std::min(asked, kMaxReaders);
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

// An argument as messages name it: `name` or `name[index]`.
struct Arg {
  const char* name;
  int64_t index = -1;
};

inline std::ostream& operator<<(std::ostream& os, const Arg& a) {
  os << '`' << a.name;
  if (a.index >= 0) os << '[' << a.index << ']';
  return os << '`';
}

// A file descriptor the kernels pread from (or pwrite to): open, not a directory, and open in
// that direction, so a wrong one is refused by name before any byte moves. Returns the file's
// size for a regular file, -1 for anything else (a device, a pipe).
inline int64_t check_fd(int64_t fd, bool write, const char* op, Arg arg) {
  ZF_CHECK(fd >= 0 && fd <= INT_MAX, op, ": ", arg, " = ", fd, " is not an fd");
  struct stat st;
  // Tagged "[errno N]" as a failed read or write is, so that the Python side raises the OSError
  // (EBADF, EISDIR) the call would have met, naming the argument.
  ZF_CHECK(::fstat(static_cast<int>(fd), &st) == 0, "zerofast: ", op, ": ", arg, " = ", fd,
           " is not an open file descriptor [errno ", EBADF, "]");
  ZF_CHECK(!S_ISDIR(st.st_mode), "zerofast: ", op, ": ", arg, " = ", fd, " is a directory, not a file [errno ",
           EISDIR, "]");
  const int mode = ::fcntl(static_cast<int>(fd), F_GETFL) & O_ACCMODE;
  ZF_CHECK(write ? mode == O_WRONLY || mode == O_RDWR : mode == O_RDONLY || mode == O_RDWR, "zerofast: ", op,
           ": ", arg, " = ", fd, " is not open for ", write ? "writing" : "reading", " [errno ", EBADF, "]");
  return S_ISREG(st.st_mode) ? static_cast<int64_t>(st.st_size) : -1;
}

// A source of the batched readers (read_cast, check_ranges): the tensor's bytes in memory, or
// the same bytes at `file_off` of file `fd`.
struct Source {
  const char* mem;  // the tensor's data: read when there is no file to read from
  int fd;           // -1: copy from `mem`
  int64_t file_off;
  int64_t itemsize;
  c10::ScalarType dtype;
};

// The sources of one call, every argument checked before a byte is read. A source read from a
// regular file must lie within it: a file cut short since the loader checked it is EIO, as a
// failed read is. `strided_files`: a source read from its file may be any CPU tensor of its dtype
// and length (check_ranges' stand-ins); otherwise every source is a contiguous CPU tensor.
inline std::vector<Source> make_sources(const char* op, const std::vector<Tensor>& sources, IntList fds,
                                        const Tensor& offsets, bool strided_files) {
  const auto n = static_cast<int64_t>(sources.size());
  ZF_CHECK(static_cast<int64_t>(fds.size()) == n, op, ": `source_fds` must hold one entry per source (", n,
           "), got ", fds.size());
  ZF_CHECK(is_cpu(offsets.device()) && offsets.scalar_type() == c10::ScalarType::Long && offsets.dim() == 1 &&
               offsets.size(0) == n && offsets.is_contiguous(),
           op, ": `source_offsets` must be a contiguous CPU int64 tensor of shape [", n, "], got ",
           offsets.scalar_type(), " ", sizes_text(offsets.sizes()), " on ", device_text(offsets.device()));
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  std::vector<Source> out;
  out.reserve(static_cast<size_t>(n));
  int64_t last_fd = -1, last_size = -1;  // sources of one file come together: one fstat for them all
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = sources[i];
    const bool file = fds[i] >= 0;
    ZF_CHECK(is_cpu(s.device()) && (s.is_contiguous() || (strided_files && file)), op, ": `sources[", i, "]` must be ",
             strided_files ? "a CPU tensor, contiguous unless it is read from its file" : "a contiguous CPU tensor",
             ", got a ", s.is_contiguous() ? "contiguous" : "non-contiguous", " one on ", device_text(s.device()));
    const auto itemsize = static_cast<int64_t>(s.element_size());
    if (file) {
      ZF_CHECK(s.numel() <= std::numeric_limits<int64_t>::max() / itemsize, op, ": `sources[", i, "]` has ",
               s.numel(), " elements, more bytes than any file holds");
      const int64_t nbytes = s.numel() * itemsize;
      ZF_CHECK(off[i] >= 0 && off[i] <= std::numeric_limits<int64_t>::max() - nbytes, op, ": `source_offsets[", i,
               "]` = ", off[i], ": source ", i, " reads ", nbytes, " bytes there, past any file");
      if (fds[i] != last_fd) {
        last_size = check_fd(fds[i], false, op, {"source_fds", i});
        last_fd = fds[i];
      }
      ZF_CHECK(last_size < 0 || off[i] + nbytes <= last_size, "zerofast: ", op, ": `sources[", i,
               "]` is read from bytes [", off[i], ", ", off[i] + nbytes, ") of the file of `source_fds[", i,
                  "]`, which ends at byte ", last_size, ": it was truncated after it was opened [errno ", EIO, "]");
    }
    out.push_back({static_cast<const char*>(s.const_data_ptr()), file ? static_cast<int>(fds[i]) : -1,
                   file ? off[i] : 0, itemsize, s.scalar_type()});
  }
  return out;
}

}  // namespace zerofast::cpu
