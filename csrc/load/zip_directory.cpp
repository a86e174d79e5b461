// See zip_directory.h. Each step mirrors one of archive.py's (_central_directory, _zip64_end,
// _zip64_fields, _entries, index_archive); where archive.py would raise, this declines.
#include "zip_directory.h"

#include <pybind11/stl.h>  // the paths, a list of str or bytes

#include <cerrno>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <string_view>
#include <system_error>
#include <thread>

#include "pickle_scan.h"
#include "torch_kit.h"

namespace py = pybind11;

namespace zerofast::load {
namespace {

constexpr uint64_t kSat32 = 0xFFFFFFFFu;
constexpr int64_t kEocd = 22, kLocator = 20, kZip64Eocd = 56, kCentral = 46, kLocal = 30;
constexpr int64_t kMaxComment = 0xFFFF;


char lower_char(char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; }

// How `a` compares with `b`, both lower-cased, byte by byte: the order `others` is sorted in.
int compare_lower(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = (unsigned char)lower_char(a[i]), y = (unsigned char)lower_char(b[i]);
    if (x != y) return x < y ? -1 : 1;
  }
  return a.size() == b.size() ? 0 : (a.size() < b.size() ? -1 : 1);
}

// Whether `s` starts with `head`, ignoring case: first as spelled (every name of a torch.save
// archive repeats the first one's folder exactly), then letter by letter.
bool starts_lower(std::string_view s, std::string_view head) {
  if (s.size() < head.size()) return false;
  if (s.compare(0, head.size(), head) == 0) return true;
  return compare_lower(s.substr(0, head.size()), head) == 0;
}

// A file's bytes for one read: mapped read-only, or (files of at most `whole` bytes) read into
// a buffer of their own, which zip_directories hands to Python as a uint8 tensor.
class FileBytes {
 public:
  FileBytes(const std::string& path, int64_t whole) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw Declined("cannot open");
    struct stat st {};
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) throw Declined("not a regular file");
    size_ = st.st_size;
    identity_ = {int64_t(st.st_dev), int64_t(st.st_ino), int64_t(st.st_size),
                 int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec)};
    if (size_ <= whole) {
      read_whole();
      return;
    }
    void* p = ::mmap(nullptr, size_t(size_), PROT_READ, MAP_PRIVATE, fd_, 0);
    if (p == MAP_FAILED) throw Declined("cannot map");
    mapped_ = true;
    data_ = static_cast<const uint8_t*>(p);
  }
  ~FileBytes() { release(); }
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  // The bytes where they were read whole (empty where mapped).
  std::string take_read() { return std::move(read_); }
  // What archive.py's file_identity takes from a stat: (dev, inode, size, mtime in ns).
  const std::array<int64_t, 4>& identity() const { return identity_; }
  void release() {  // the unmap and the close, early
    if (mapped_) ::munmap(const_cast<uint8_t*>(data_), size_t(size_));
    if (fd_ >= 0) ::close(fd_);
    mapped_ = false, fd_ = -1;
  }

 private:
  // One pread (a few for a file that arrives in pieces): at this size a mapping, its page
  // faults and its unmap cost several times the copy.
  void read_whole() {
    // Into a buffer of our own: a tensor is made only with the GIL (zip_directories).
    read_.resize(size_t(size_));
    auto* out = reinterpret_cast<uint8_t*>(read_.data());
    int64_t done = 0;
    while (done < size_) {
      ssize_t got = ::pread(fd_, out + done, size_t(size_ - done), off_t(done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) throw Declined("a short read");  // the file shrank meanwhile, or an I/O error
      done += got;
    }
    data_ = out;
  }

  int fd_ = -1;
  int64_t size_ = 0;
  bool mapped_ = false;
  const uint8_t* data_ = nullptr;
  std::string read_;
  std::array<int64_t, 4> identity_{};
};

struct Raw {  // one central-directory entry, offsets relative to the archive's start
  size_t name_at;  // its name, already in ZipDirectory::names
  uint16_t name_len;
  bool compressed;
  __int128 header_offset;
  uint64_t stored_size, size;
};

class Parser {
 public:
  Parser(const uint8_t* file, int64_t start, int64_t end) : f_(file), start_(start), end_(end) {}

  ZipDirectory run() {
    ZipDirectory d;
    std::vector<Raw> raw = central_directory(d);
    entries(raw, d);
    return d;
  }

 private:
  const uint8_t* f_;
  int64_t start_, end_;

  // Bytes [pos, pos + len) of the archive; archive.py's reads there would come back short.
  const uint8_t* at(__int128 pos, __int128 len) const {
    if (pos < start_ || len < 0 || pos + len > end_) throw Declined("a read outside the archive");
    return f_ + int64_t(pos);
  }

  std::vector<Raw> central_directory(ZipDirectory& d) {
    const int64_t tail_size = std::min<int64_t>(end_ - start_, kEocd + kMaxComment);
    const uint8_t* tail = at(end_ - tail_size, tail_size);
    int64_t found = -1;
    for (int64_t i = tail_size - 4; i >= 0; --i)
      if (std::memcmp(tail + i, "PK\x05\x06", 4) == 0) {
        found = i;
        break;
      }
    if (found < 0 || found + kEocd > tail_size) throw Declined("no end of central directory record");
    const int64_t eocd = end_ - tail_size + found;
    const uint8_t* e = f_ + eocd;
    uint64_t count = little(e + 10, 2), cd_size = little(e + 12, 4), cd_offset = little(e + 16, 4);
    __int128 cd_end = eocd;
    const int64_t locator = eocd - kLocator;
    bool has_locator = locator >= start_ && std::memcmp(f_ + locator, "PK\x06\x07", 4) == 0;
    if (has_locator || count == 0xFFFF || cd_size == kSat32 || cd_offset == kSat32) {
      if (!has_locator) throw Declined("zip64 without a locator");
      __int128 record = __int128(little(f_ + locator + 8, 8)) + start_;
      if (record + kZip64Eocd > locator) throw Declined("zip64 end record misplaced");
      const uint8_t* r = at(record, kZip64Eocd);
      if (std::memcmp(r, "PK\x06\x06", 4) != 0) throw Declined("no zip64 end record");
      count = little(r + 32, 8);
      cd_size = little(r + 40, 8);
      cd_offset = little(r + 48, 8);
      cd_end = record;
    }
    if (__int128(cd_offset) + __int128(cd_size) != cd_end - start_) throw Declined("directory misplaced");
    const uint8_t* dir = at(__int128(start_) + cd_offset, cd_size);
    // Each entry takes at least kCentral bytes (the loop below would find the last cut short);
    // entry indices are int32 (ZipDirectory::numbered).
    if (count > cd_size / kCentral) throw Declined("directory entry cut short");
    if (count > uint64_t(INT32_MAX)) throw Declined("too many entries");
    std::vector<Raw> out;
    out.reserve(size_t(count));
    // Room for names as long as torch.save's usually are; not all the directory leaves them,
    // which a file with a few entries and a huge extra field would make gigabytes.
    d.names.reserve(size_t(std::min<uint64_t>(cd_size - count * kCentral, count * 64)));
    uint64_t pos = 0;
    for (uint64_t i = 0; i < count; ++i) out.push_back(central_entry(dir, cd_size, &pos, &d.names));
    if (pos != cd_size) throw Declined("bytes after the directory's entries");
    return out;
  }

  static Raw central_entry(const uint8_t* dir, uint64_t dir_size, uint64_t* pos, std::string* names) {
    if (*pos + kCentral > dir_size) throw Declined("directory entry cut short");
    const uint8_t* c = dir + *pos;
    if (std::memcmp(c, "PK\x01\x02", 4) != 0) throw Declined("not a directory entry");
    uint64_t method = little(c + 10, 2), csize = little(c + 20, 4), usize = little(c + 24, 4);
    uint64_t name_len = little(c + 28, 2), extra_len = little(c + 30, 2), comment_len = little(c + 32, 2);
    uint64_t offset = little(c + 42, 4);
    uint64_t name_at = *pos + kCentral;
    if (name_at + name_len + extra_len > dir_size) throw Declined("directory entry cut short");
    const uint8_t* name = dir + name_at;
    uint8_t bits = 0;  // or-ed over the name: one loop the compiler vectorizes, no branch a byte
    for (uint64_t i = 0; i < name_len; ++i) bits |= name[i];
    if (bits >= 0x80) throw Declined("a name that is not ASCII");
    if (csize == kSat32 || usize == kSat32 || offset == kSat32)
      zip64_fields(dir + name_at + name_len, extra_len, &usize, &csize, &offset);
    *pos = name_at + name_len + extra_len + comment_len;
    const size_t at = names->size();
    names->append(reinterpret_cast<const char*>(name), size_t(name_len));
    return Raw{at, uint16_t(name_len), method != 0, __int128(offset), csize, usize};
  }

  static void zip64_fields(const uint8_t* extra, uint64_t len, uint64_t* usize, uint64_t* csize, uint64_t* offset) {
    uint64_t pos = 0;
    while (pos + 4 <= len) {
      uint64_t tag = little(extra + pos, 2), length = little(extra + pos + 2, 2);
      if (tag == 1) {
        uint64_t n = length / 8;
        if (pos + 4 + 8 * n > len) throw Declined("zip64 field cut short");
        uint64_t used = 0;
        for (uint64_t* field : {usize, csize, offset}) {
          if (*field != kSat32) continue;
          if (used == n) throw Declined("zip64 field too short");
          *field = little(extra + pos + 4 + 8 * used++, 8);
        }
        return;
      }
      pos += 4 + length;
    }
    throw Declined("no zip64 field");
  }

  void entries(const std::vector<Raw>& raw, ZipDirectory& d) {
    if (raw.empty() || std::string_view(d.names).substr(raw[0].name_at, raw[0].name_len).find('/') == std::string_view::npos)
      throw Declined("not entries in one folder");
    d.entries.reserve(raw.size());
    for (const Raw& r : raw) {
      __int128 header = r.header_offset + start_;
      const uint8_t* h = at(header, kLocal);
      if (std::memcmp(h, "PK\x03\x04", 4) != 0) throw Declined("no local header");
      __int128 data = header + kLocal + little(h + 26, 2) + little(h + 28, 2);
      if (data + __int128(r.stored_size) > end_) throw Declined("entry past the end");
      if (r.size > uint64_t(INT64_MAX)) throw Declined("entry size");
      d.entries.push_back(ZipEntry{r.name_at, r.name_len, r.compressed, int64_t(header), int64_t(data),
                                   int64_t(r.stored_size), int64_t(r.size)});
    }
    no_overlaps(d.entries);
    const std::string_view first = d.name(0);
    d.prefix = std::string(first.substr(0, first.find('/')));
    d.folder = d.prefix + "/data/";
    index_names(d);
    int64_t pkl = d.find(d.prefix + "/data.pkl");
    if (pkl < 0 || d.entries[size_t(pkl)].compressed) throw Declined("no stored data.pkl");
    d.pickle_offset = d.entries[size_t(pkl)].data_offset;
    d.pickle_size = d.entries[size_t(pkl)].stored_size;
  }

  // archive.py's dict of lower-cased names, and its check that no name comes twice. A name's
  // lower-cased form decides whether it is a numbered one (the folder, "/data/", a decimal
  // below the count; digits have no case) and which number, so two names equal without case
  // meet either in one slot of `numbered` or side by side in the sorted `others`.
  static void index_names(ZipDirectory& d) {
    d.numbered.assign(d.entries.size(), -1);
    for (size_t i = 0; i < d.entries.size(); ++i) {
      int64_t n = d.number_of(d.name(i));
      if (n < 0) {
        d.others.push_back(int32_t(i));
      } else {
        if (d.numbered[size_t(n)] >= 0) throw Declined("a name twice");
        d.numbered[size_t(n)] = int32_t(i);
      }
    }
    std::sort(d.others.begin(), d.others.end(),
              [&d](int32_t a, int32_t b) { return compare_lower(d.name(size_t(a)), d.name(size_t(b))) < 0; });
    for (size_t i = 1; i < d.others.size(); ++i)
      if (compare_lower(d.name(size_t(d.others[i - 1])), d.name(size_t(d.others[i]))) == 0)
        throw Declined("a name twice");
  }

  static bool ends_before(const ZipEntry& a, const ZipEntry& b) {
    return a.data_offset + a.stored_size <= b.header_offset;
  }

  // torch.save writes the entries in file order: then each need only be checked against the
  // next, without sorting 50k of them.
  static void no_overlaps(const std::vector<ZipEntry>& entries) {
    size_t i = 1;
    for (; i < entries.size() && entries[i - 1].header_offset <= entries[i].header_offset; ++i)
      if (!ends_before(entries[i - 1], entries[i])) throw Declined("entries overlap");
    if (i == entries.size()) return;
    std::vector<const ZipEntry*> order;
    order.reserve(entries.size());
    for (const ZipEntry& e : entries) order.push_back(&e);
    std::sort(order.begin(), order.end(),
              [](const ZipEntry* a, const ZipEntry* b) { return a->header_offset < b->header_offset; });
    for (size_t j = 1; j < order.size(); ++j)
      if (!ends_before(*order[j - 1], *order[j])) throw Declined("entries overlap");
  }
};

py::tuple zip_directory(const std::string& path, int64_t start, int64_t end) {
  try {
    std::shared_ptr<ZipDirectory> d;
    std::unique_ptr<FileBytes> file;
    {
      py::gil_scoped_release unlocked;  // touches no Python object
      file = std::make_unique<FileBytes>(path, 0);
      if (start < 0 || start > end || end > file->size()) throw Declined("archive bounds");
      d = std::make_shared<ZipDirectory>(Parser(file->data(), start, end).run());
    }
    // data.pkl copied once, from the mapping into the bytes object (a copy into a std::string
    // first would copy its megabytes twice); the object is made with the GIL, filled without it
    // (the copy may fault the pickle's pages in from disk: other threads run meanwhile).
    PyObject* raw = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(d->pickle_size));
    if (!raw) throw py::error_already_set();
    py::bytes pickle = py::reinterpret_steal<py::bytes>(raw);
    {
      py::gil_scoped_release unlocked;
      std::memcpy(PyBytes_AS_STRING(raw), file->data() + d->pickle_offset, size_t(d->pickle_size));
      file.reset();  // the unmap, also without the GIL
    }
    return py::make_tuple(true, d, pickle);
  } catch (const Declined& e) {
    return py::make_tuple(false, std::string(e.what()), py::none());
  }
}

// One file of zip_directories, read on a pool thread: its directory, and data.pkl either as a
// range of the bytes read whole or copied out of the mapping before it is unmapped.
struct OneFile {
  std::shared_ptr<ZipDirectory> directory;
  std::string whole;  // the file's bytes, where it was read whole
  std::string pickle;  // where the file was mapped
  std::array<int64_t, 4> identity{};
  std::string declined;
};

OneFile read_one(const std::string& path, int64_t whole) {
  OneFile one;
  try {
    FileBytes file(path, whole);
    one.identity = file.identity();
    one.directory = std::make_shared<ZipDirectory>(Parser(file.data(), 0, file.size()).run());
    one.whole = file.take_read();
    if (one.whole.empty())
      one.pickle.assign(reinterpret_cast<const char*>(file.data() + one.directory->pickle_offset),
                        size_t(one.directory->pickle_size));
  } catch (const Declined& e) {
    one = OneFile{};
    one.declined = e.what();
  } catch (...) {  // out of memory: this file is left to archive.py, not the batch
    one = OneFile{};
    one.declined = "native error";
  }
  return one;
}

// read_one of every path, on `threads` threads (this one among them), each taking the next
// path not yet taken: files differ in size, so no fixed split.
std::vector<OneFile> read_all(const std::vector<std::string>& paths, int64_t whole, int64_t threads) {
  std::vector<OneFile> read(paths.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < paths.size(); i = next++) read[i] = read_one(paths[i], whole);
  };
  const size_t helpers = size_t(std::clamp<int64_t>(threads, 1, int64_t(std::max<size_t>(paths.size(), 1)))) - 1;
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  try {
    for (size_t i = 0; i < helpers; ++i) pool.emplace_back(work);
  } catch (const std::system_error&) {  // no more threads to be had: those started do the rest
  }
  work();
  for (std::thread& t : pool) t.join();
  return read;
}

// A uint8 tensor holding `bytes` (torch.empty(n, dtype=torch.uint8) through the bound kit,
// then filled): what archive.py keeps as the file's bytes and the reader cuts storages from.
py::object bytes_tensor(const std::string& bytes) {
  py::object n = own(PyLong_FromSize_t(bytes.size()), "int");
  py::object t = own(PyObject_CallOneArg(bound_kit().empty_bytes, n.ptr()), "tensor");
  py::object address = call_method(t.ptr(), names().data_ptr);
  void* at = reinterpret_cast<void*>(uintptr_t(int64_of(address.ptr(), "data_ptr")));
  std::memcpy(at, bytes.data(), bytes.size());
  return t;
}

py::list zip_directories(const std::vector<std::string>& paths, int64_t whole, int64_t threads) {
  bound_kit();  // before any file is read: without it, the whole batch is left to archive.py
  std::vector<OneFile> read;
  {
    py::gil_scoped_release unlocked;  // opening, reading and checking thousands of files: no Python
    read = read_all(paths, whole, threads);
  }
  py::list out;
  for (OneFile& one : read) {
    if (!one.directory) {
      out.append(py::make_tuple(false, one.declined, py::none(), py::none(), py::none()));
      continue;
    }
    const ZipDirectory& d = *one.directory;
    py::bytes pickle = !one.whole.empty()
        ? py::bytes(one.whole.data() + d.pickle_offset, size_t(d.pickle_size))
        : py::bytes(one.pickle);
    std::string().swap(one.pickle);  // the batch holds each pickle once, not twice
    py::object whole_bytes = py::none();
    if (!one.whole.empty()) {
      whole_bytes = bytes_tensor(one.whole);
      std::string().swap(one.whole);
    }
    const auto& id = one.identity;
    out.append(py::make_tuple(true, one.directory, pickle, whole_bytes, py::make_tuple(id[0], id[1], id[2], id[3])));
  }
  return out;
}

py::list entry_tuples(const ZipDirectory& d) {
  py::list out;
  for (size_t i = 0; i < d.entries.size(); ++i) {
    const ZipEntry& e = d.entries[i];
    const std::string_view name = d.name(i);
    out.append(py::make_tuple(py::str(name.data(), name.size()), e.data_offset, e.stored_size, e.size, e.compressed));
  }
  return out;
}

// The checks ArchiveIndex.storage_offset makes of the entry it found.
int64_t stored_data(const ZipDirectory& d, int64_t at, int64_t nbytes) {
  if (at < 0) return -1;
  const ZipEntry& e = d.entries[size_t(at)];
  if (e.compressed || e.stored_size != e.size || e.size != nbytes) return -1;
  return e.data_offset;
}

}  // namespace

int64_t ZipDirectory::number_of(std::string_view name) const {
  if (name.size() <= folder.size() || !starts_lower(name, folder)) return -1;
  return numbered_key(name.data() + folder.size(), name.size() - folder.size(), entries.size());
}

int64_t ZipDirectory::find(std::string_view name) const {
  int64_t n = number_of(name);
  if (n >= 0) return numbered[size_t(n)];  // -1 where no entry has that number: no other could match
  auto at = std::lower_bound(others.begin(), others.end(), name, [this](int32_t i, std::string_view key) {
    return compare_lower(this->name(size_t(i)), key) < 0;
  });
  return at != others.end() && compare_lower(this->name(size_t(*at)), name) == 0 ? *at : -1;
}

int64_t ZipDirectory::storage_offset(const std::string& key, int64_t nbytes) const {
  for (unsigned char ch : key)
    if (ch >= 0x80) return -1;
  return stored_data(*this, find(folder + key), nbytes);
}

int64_t numbered_key(const char* key, size_t len, size_t bound) {
  if (len == 0 || len > 10 || (len > 1 && key[0] == '0')) return -1;
  uint64_t n = 0;
  for (size_t i = 0; i < len; ++i) {
    if (key[i] < '0' || key[i] > '9') return -1;
    n = n * 10 + uint64_t(key[i] - '0');
  }
  return n < bound ? int64_t(n) : -1;
}

int64_t ZipDirectory::storage_offset(const char* key, size_t len, int64_t nbytes) const {
  int64_t n = numbered_key(key, len, numbered.size());
  if (n < 0) return storage_offset(std::string(key, len), nbytes);
  return stored_data(*this, numbered[size_t(n)], nbytes);  // where it is -1, no other name matches either
}

void register_zip_directory(py::module_& m) {
  py::class_<ZipDirectory, std::shared_ptr<ZipDirectory>>(m, "ZipDirectory")
      .def_readonly("prefix", &ZipDirectory::prefix)
      .def("__len__", [](const ZipDirectory& d) { return d.entries.size(); })
      .def("entries", &entry_tuples, "(name, data offset, stored size, size, compressed) per entry, in order")
      .def("storage_offset",  // the unpickler's lookup (by number where the key is one)
           [](const ZipDirectory& d, const std::string& key, int64_t nbytes) {
             return d.storage_offset(key.data(), key.size(), nbytes);
           },
           py::arg("key"), py::arg("nbytes"),
           "file offset of a storage, or -1 where archive.py's check would raise");
  m.def("zip_directory", &zip_directory, py::arg("path"), py::arg("start"), py::arg("end"),
        "Read and check a torch.save zip directory natively: (True, ZipDirectory, data.pkl bytes), or "
        "(False, why, None) when archive.py must decide");
  m.def("zip_directories", &zip_directories, py::arg("paths"), py::arg("whole"), py::arg("threads"),
        "zip_directory of whole files, on `threads` threads without the GIL: per path (True, ZipDirectory, "
        "data.pkl bytes, the file's bytes as a uint8 tensor where it holds at most `whole` of them else None, "
        "its (dev, inode, size, mtime_ns)), or (False, why, None, None, None) when archive.py must decide");
}

}  // namespace zerofast::load
