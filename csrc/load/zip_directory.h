// The native reader of a torch.save archive's zip directory: a port of
// zerofast/load/archive.py's checks, without a Python object per entry.
//
// It reads the end records (zip64 included), the central directory and every local header, and
// checks what archive.py checks: each entry lies inside the archive, no two names are equal
// case-insensitively, no two entries overlap, data.pkl is there and stored. It handles only
// ASCII names (the only ones torch.save writes); anything else, and any failed check, declines,
// and archive.py reads the file and words the verdict, so messages are the reference's.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace zerofast::load {

struct ZipEntry {
  std::string name;
  int64_t header_offset;
  int64_t data_offset;
  int64_t stored_size;
  int64_t size;
  bool compressed;
};

class ZipDirectory {
 public:
  std::string prefix;
  std::vector<ZipEntry> entries;  // in directory order
  std::unordered_map<std::string, size_t> by_lower;
  int64_t pickle_offset = 0;  // data.pkl's data, in file offsets
  int64_t pickle_size = 0;

  // The file offset of storage `key` holding `nbytes`, as ArchiveIndex.storage_offset checks it;
  // -1 where that would raise (or the key is not ASCII): the reference then decides.
  int64_t storage_offset(const std::string& key, int64_t nbytes) const;
  // The same lookup for a key given as bytes: a decimal key (what torch.save writes) is found
  // by its number, without building and hashing the entry's name.
  int64_t storage_offset(const char* key, size_t len, int64_t nbytes) const;

  // Entry index of "<prefix>/data/<n>" (matched as by_lower matches), or -1, for n below the
  // number of entries: the storages' names as numbers.
  std::vector<int32_t> numbered;
};

// `n` where key[0, len) is n written in decimal as Python's str(n) writes it (no sign, no
// leading zero), for n < bound; -1 for any other key.
int64_t numbered_key(const char* key, size_t len, size_t bound);

// Adds `zip_directory(path, start, end) -> (True, ZipDirectory, pickle bytes) | (False, why)`
// and the ZipDirectory class to the _C module.
void register_zip_directory(pybind11::module_& m);

}  // namespace zerofast::load
