// libmembox.so: the static layer libraries linked whole into one shared
// library (see CMakeLists.txt). This file only gives the target a source.
namespace membox {
extern const char kSharedLibrary[] = "membox";
}  // namespace membox
