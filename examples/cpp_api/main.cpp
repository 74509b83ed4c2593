// The quick start from C++: Fashion-MNIST, a small CNN, two stages, the safety nets, and the
// memory report. Build: part of the frugal build (build/bin/frugal_cpp_api), or out of tree
// against an installed frugal (see CMakeLists.txt).
//   frugal_cpp_api [fashion-mnist folder] [training samples, 0 = all]
#include <iostream>
#include <memory>
#include <string>

#include <frugal/frugal.h>

int main(int argc, char** argv) {
  frugal::select_blas_core();       // first: OpenBLAS's kernels for a CPU it does not know
  frugal::MemoryMeter::install();  // count every tensor from here on
  torch::manual_seed(0);
  frugal::set_threads(2);  // 2 ATen threads, 1 BLAS thread: the two pools do not share cores

  frugal::DataOptions data;
  data.path = argc > 1 ? argv[1] : frugal::kFashionMnistDir;
  data.train_samples = argc > 2 ? std::stoll(argv[2]) : 0;     // 0 = all 60000
  data.valid_samples = data.train_samples > 0 ? std::max<int64_t>(data.train_samples / 4, 1) : 0;

  frugal::DataLoader train(frugal::make_dataset(data, /*train=*/true), /*batch_size=*/128,
                           /*shuffle=*/true, /*seed=*/0);
  frugal::DataLoader valid(frugal::make_dataset(data, /*train=*/false), 1000, false, 0);

  frugal::ModelOptions model;
  model.arch = "cnn";
  model.width = 16;
  frugal::OptimizerOptions adam;
  adam.lr = 2e-3;
  frugal::Learner learner(frugal::make_model(model, frugal::ModelInput{}), std::move(train),
                          std::move(valid), adam, frugal::make_loss(frugal::LossOptions{}));
  // The safety nets a TOML run gets from run.on_nonfinite and run.early_stopping: an inf/NaN
  // loss or gradient stops the fit naming where; the fit ends once the validation loss has not
  // improved by more than 0.001 for 2 epochs.
  learner.add_callback(std::make_shared<frugal::NonFiniteCheck>());
  auto early = std::make_shared<frugal::EarlyStopping>(frugal::MetricMonitor("valid_loss", 1e-3),
                                                       /*patience=*/2);
  learner.add_callback(early);

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
            << frugal::format_bytes(report["peak_bytes"].get<int64_t>()) << "; early stopping: "
            << early->record().dump() << "\n";
  return 0;
}
