# Conan 2 recipe for tandem, a header-only library, and its tools: the options gloo ... io only
# decide which components a consumer gets, each one linking a library that the machine provides
# (Debian's libgloo-dev, an MPI, the CUDA toolkit and NCCL, zlib for the data readers,
# nlohmann-json for io, libtorch for torch: Debian's libtorch-dev, or PyTorch's wheel through
# CMAKE_PREFIX_PATH). The tools option (on by default) builds tandemrun (with the machine's
# CLI11) and, with io, tandem-ckpt into bin/; with tools=False the package is headers only, one
# package for every configuration (the package id is empty).
#   conan create packaging/conan -s compiler.cppstd=20 [-o "tandem/*:gloo=True"]
import os
import re

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain
from conan.tools.files import copy, load
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0"


class TandemConan(ConanFile):
    name = "tandem"
    description = "Header-only C++20 data-parallel training: DDP, samplers, AMP, launchers"
    license = "MIT"
    topics = ("distributed", "training", "ddp", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {"gloo": [True, False], "mpi": [True, False], "cuda": [True, False], "nccl": [True, False], "data": [True, False], "io": [True, False], "torch": [True, False], "tools": [True, False]}
    default_options = {"gloo": False, "mpi": False, "cuda": False, "nccl": False, "data": False, "io": False, "torch": False, "tools": True}
    no_copy_source = True

    # The recipe lives two folders below the sources it packages.
    @property
    def _repo(self):
        return os.path.join(self.recipe_folder, "..", "..")

    def set_version(self):
        config = load(self, os.path.join(self._repo, "include", "tandem", "core", "config.hpp"))
        parts = [re.search(rf"#define TANDEM_VERSION_{p} (\d+)", config).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def export_sources(self):
        # The headers, and what building the tools takes: the CMake project and tools/.
        for pattern in ("include/*", "LICENSE", "CMakeLists.txt", "tools/*", "cmake/*"):
            copy(self, pattern, self._repo, self.export_sources_folder)
        copy(self, "FindNCCL.cmake", os.path.join(self._repo, "cmake"), os.path.join(self.export_sources_folder, "cmake"))
        copy(self, "tandem-engines.cmake", self.recipe_folder, os.path.join(self.export_sources_folder, "cmake"))

    def layout(self):
        basic_layout(self, src_folder=".")

    def configure(self):
        if not self.options.tools:
            self.package_type = "header-library"

    def package_id(self):
        if not self.info.options.tools:
            self.info.clear()

    def validate(self):
        if self.settings.get_safe("compiler.cppstd"):
            check_min_cppstd(self, 20)
        if self.settings.os != "Linux":
            raise ConanInvalidConfiguration("tandem supports Linux only (POSIX sockets, fork, /proc)")
        if self.options.nccl and not self.options.cuda:
            raise ConanInvalidConfiguration("tandem/*:nccl=True needs tandem/*:cuda=True")

    def source(self):
        pass  # export_sources brought everything

    def generate(self):
        if not self.options.tools:
            return
        toolchain = CMakeToolchain(self)
        toolchain.cache_variables.update({
            "TANDEM_BUILD_TOOLS": "ON",
            "TANDEM_WITH_IO": "ON" if self.options.io else "OFF",
            "TANDEM_WITH_DATA": "OFF", "TANDEM_WITH_GLOO": "OFF", "TANDEM_WITH_MPI": "OFF",
            "TANDEM_WITH_CUDA": "OFF",
            # The tools do not use libtorch; ON checks at package time that it is found.
            "TANDEM_WITH_TORCH": "ON" if self.options.torch else "OFF",
        })
        toolchain.generate()

    def build(self):
        if not self.options.tools:
            return  # nothing to compile
        cmake = CMake(self)
        cmake.configure()
        cmake.build(target="tandemrun")
        if self.options.io:
            cmake.build(target="tandem-ckpt")

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        copy(self, "*.hpp", os.path.join(self.source_folder, "include"), os.path.join(self.package_folder, "include"))
        copy(self, "*.cmake", os.path.join(self.source_folder, "cmake"), os.path.join(self.package_folder, "lib", "cmake", "tandem"))
        if self.options.tools:
            for tool in ("tandemrun", "tandem-ckpt"):
                copy(self, tool, os.path.join(self.build_folder, "tools"), os.path.join(self.package_folder, "bin"), keep_path=False)

    def package_info(self):
        # find_package(tandem CONFIG) gives the same targets as tandem's own CMake package:
        # tandem::tandem, and tandem::gloo / mpi / cuda / nccl / data / io / torch for the options that are on.
        bindirs = ["bin"] if self.options.tools else []
        self.cpp_info.bindirs = bindirs
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "tandem")
        self.cpp_info.set_property("cmake_target_name", "tandem::all")
        # Finds each engine's own CMake package and links it into its component's target.
        self.cpp_info.set_property("cmake_build_modules", [os.path.join("lib", "cmake", "tandem", "tandem-engines.cmake")])
        self.cpp_info.builddirs = [os.path.join("lib", "cmake", "tandem")]

        core = self.cpp_info.components["core"]
        core.set_property("cmake_target_name", "tandem::tandem")
        core.bindirs = bindirs  # the tools, on PATH in a consumer's run environment
        core.libdirs = []
        core.system_libs = ["pthread"]

        engines = {"gloo": (["gloo"], ["core"]), "mpi": (["mpi"], ["core"]), "cuda": (["cudart"], ["core"]), "nccl": (["nccl"], ["cuda"]), "data": (["z"], ["core"]), "io": ([], ["core"]), "torch": ([], ["core"])}
        for name, (system_libs, requires) in engines.items():
            if not self.options.get_safe(name):
                continue
            component = self.cpp_info.components[name]
            component.set_property("cmake_target_name", f"tandem::{name}")
            component.bindirs = []
            component.libdirs = []
            component.includedirs = []
            component.system_libs = system_libs
            component.requires = requires
