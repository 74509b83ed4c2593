// The quick start from C++: Fashion-MNIST, a small CNN, two stages, and the memory report.
// Build: part of the frugal build (build/bin/frugal_cpp_api), or against an installed frugal.
#include <iostream>

#include <frugal/frugal.h>

int main(int argc, char** argv) {
  frugal::MemoryMeter::install();  // count every tensor from here on
  torch::manual_seed(0);
  const std::string dir = argc > 1 ? argv[1] : frugal::kFashionMnistDir;

  frugal::DataLoader train(frugal::load_fashion_mnist(dir, /*train=*/true), /*batch_size=*/128,
                           /*shuffle=*/true, /*seed=*/0);
  frugal::DataLoader valid(frugal::load_fashion_mnist(dir, /*train=*/false), 1000, false, 0);

  frugal::ModelOptions model;
  model.arch = "cnn";
  frugal::ModelInput input;
  input.image_sizes = {14, 28};

  frugal::OptimizerOptions adam;
  adam.lr = 2e-3;
  frugal::Learner learner(frugal::make_model(model, input), std::move(train), std::move(valid),
                          adam, frugal::make_loss(frugal::LossOptions{}));

  frugal::Stage warmup;
  warmup.name = "warmup-14px";
  warmup.image_size = 14;
  frugal::Stage full;
  full.name = "full-28px";
  full.epochs = 2;
  full.optimizer = adam;
  full.optimizer.lr = 1e-3;
  full.has_optimizer = true;
  learner.fit({warmup, full});

  std::cout << learner.report().dump(2) << "\n";
  std::cout << "validation accuracy " << 100 * learner.valid_accuracy() << "%, peak live memory "
            << frugal::format_bytes(learner.report()["peak_bytes"].get<int64_t>()) << "\n";
  return 0;
}
