// The quick start from C++: Fashion-MNIST, a small CNN, two stages, and the memory report.
// Build: part of the frugal build (build/bin/frugal_cpp_api [fashion-mnist dir]).
#include <iostream>

#include <frugal/frugal.h>

int main(int argc, char** argv) {
  frugal::MemoryMeter::install();  // count every tensor from here on
  torch::manual_seed(0);
  torch::set_num_threads(2);
  const std::string dir = argc > 1 ? argv[1] : frugal::kFashionMnistDir;

  frugal::DataLoader train(frugal::load_fashion_mnist(dir, /*train=*/true), /*batch_size=*/128,
                           /*shuffle=*/true, /*seed=*/0);
  frugal::DataLoader valid(frugal::load_fashion_mnist(dir, /*train=*/false), 1000, false, 0);

  frugal::ModelOptions model;
  model.arch = "cnn";
  model.width = 16;
  frugal::OptimizerOptions adam;
  adam.lr = 2e-3;
  frugal::Learner learner(frugal::make_model(model, frugal::ModelInput{}), std::move(train),
                          std::move(valid), adam, frugal::make_loss(frugal::LossOptions{}));

  frugal::Stage warmup;
  warmup.name = "warmup";
  frugal::Stage finetune;
  finetune.name = "finetune";
  finetune.epochs = 2;
  finetune.optimizer = adam;
  finetune.optimizer.lr = 5e-4;
  finetune.has_optimizer = true;
  learner.fit({warmup, finetune});

  const auto report = learner.report();
  std::cout << report.dump(2) << "\n";
  std::cout << "validation accuracy " << 100 * learner.valid_accuracy() << "%, peak live memory "
            << frugal::format_bytes(report["peak_bytes"].get<int64_t>()) << "\n";
  return 0;
}
