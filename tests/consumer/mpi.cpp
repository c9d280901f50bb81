// SPDX-License-Identifier: Apache-2.0
// Copyright 2026 the distopt authors
// Component mpi (distopt::mpi): an optimizer over MPI_COMM_WORLD, built and linked (the test
// does not start MPI). Run under mpiexec, every rank takes one sharded AdamW step.
#include <distopt/comm/mpi.hpp>
#include <distopt/optimizer.hpp>
#include <distopt/policy/adamw.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  distopt::mpi_session session(argc, argv);
  distopt::layout tensors;
  tensors.add("w", {1000});
  distopt::optimizer<distopt::adamw, distopt::sharded<distopt::fp32>, distopt::mpi> opt(
      tensors, distopt::adamw::hyper_params{}, {}, distopt::cpu(1), distopt::mpi(MPI_COMM_WORLD));
  for (auto& g : opt.grad("w")) g = 1.0f;
  opt.step();
  std::printf("mpi: rank %d of %d stepped\n", opt.communicator().rank(), opt.communicator().size());
}
