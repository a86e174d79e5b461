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
#include <string_view>
#include <vector>

namespace zerofast::load {

struct ZipEntry {
  size_t name_at;  // the name is ZipDirectory::names[name_at, name_at + name_len)
  uint16_t name_len;
  bool compressed;
  int64_t header_offset;
  int64_t data_offset;
  int64_t stored_size;
  int64_t size;
};

class ZipDirectory {
 public:
  std::string prefix;
  std::string folder;  // prefix + "/data/": where the storages are
  std::vector<ZipEntry> entries;  // in directory order
  // Every entry's name, back to back: one allocation for the directory, not one per entry.
  std::string names;
  int64_t pickle_offset = 0;  // data.pkl's data, in file offsets
  int64_t pickle_size = 0;

  std::string_view name(size_t i) const { return std::string_view(names.data() + entries[i].name_at, entries[i].name_len); }

  // The entry named `name` matched case-insensitively (as archive.py's dict of lower-cased
  // names matches), or -1.
  int64_t find(std::string_view name) const;

  // The file offset of storage `key` holding `nbytes`, as ArchiveIndex.storage_offset checks it;
  // -1 where that would raise (or the key is not ASCII): the reference then decides.
  int64_t storage_offset(const std::string& key, int64_t nbytes) const;
  // The same lookup for a key given as bytes: a decimal key (what torch.save writes) is found
  // by its number, without building the entry's name.
  int64_t storage_offset(const char* key, size_t len, int64_t nbytes) const;

  // Entry index of "<prefix>/data/<n>" (matched case-insensitively), or -1, for n below the
  // number of entries: the storages' names as numbers.
  std::vector<int32_t> numbered;
  // The other entries (not named as one of `numbered`'s), sorted by lower-cased name: found by
  // binary search. torch.save writes a handful of them (data.pkl, version, byteorder, ...).
  std::vector<int32_t> others;

  // `n` where `name` is numbered's n-th name (matched case-insensitively), else -1.
  int64_t number_of(std::string_view name) const;
};

// `n` where key[0, len) is n written in decimal as Python's str(n) writes it (no sign, no
// leading zero), for n < bound; -1 for any other key.
int64_t numbered_key(const char* key, size_t len, size_t bound);

// Adds `zip_directory(path, start, end) -> (True, ZipDirectory, pickle bytes) | (False, why)`,
// its batch `zip_directories(paths, whole, threads)` (many whole files on `threads` threads; files
// of at most `whole` bytes read instead of mapped, handed back as uint8 tensors) and the ZipDirectory class to the
// _C module.
void register_zip_directory(pybind11::module_& m);

}  // namespace zerofast::load
