# Builds and runs a small program against the tandem package (conan create runs it).
import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout


class TandemTestConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeDeps", "VirtualRunEnv"
    test_type = "explicit"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        toolchain = CMakeToolchain(self)
        toolchain.cache_variables["TEST_GLOO"] = bool(self.dependencies["tandem"].options.gloo)
        toolchain.cache_variables["TEST_IO"] = bool(self.dependencies["tandem"].options.io)
        toolchain.cache_variables["TEST_TORCH"] = bool(self.dependencies["tandem"].options.torch)
        toolchain.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")
            tandem = self.dependencies["tandem"]
            if tandem.options.tools:
                tools = ["tandemrun"] + (["tandem-ckpt"] if tandem.options.io else [])
                for tool in tools:
                    self.run(os.path.join(tandem.package_folder, "bin", tool) + " --help")
                    self.output.info(f"{tool} --help ok")
