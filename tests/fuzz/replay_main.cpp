// replay_main.cpp: main() for a fuzz target in a build without libFuzzer (gcc, or clang without
// -DSWARM_FUZZ=ON). Runs LLVMFuzzerTestOneInput once on every file named, or every file in a
// directory named, so the committed corpus is a regression test on every build. Files named
// crash-* are skipped in a directory (known failures waiting for a fix, docs/fuzzing.md) and
// run when named one by one.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fs = std::filesystem;

namespace {

void run_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "replay: cannot read %s\n", p.c_str());
    std::exit(2);
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  size_t ran = 0, skipped = 0;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg(argv[i]);
    if (!fs::is_directory(arg)) {
      run_file(arg);
      ++ran;
      continue;
    }
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(arg))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& p : files) {
      if (p.filename().string().rfind("crash-", 0) == 0) {
        ++skipped;
        continue;
      }
      run_file(p);
      ++ran;
    }
  }
  std::printf("replay: %zu input(s) ran clean, %zu crash-* input(s) skipped\n", ran, skipped);
  return ran > 0 ? 0 : 1;
}
