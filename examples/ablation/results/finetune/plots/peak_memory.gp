# gnuplot peak_memory.gp (run in this folder) draws peak_memory.svg and .png
svg_out(name) = sprintf('set terminal svg size 900,520 dynamic font "sans,11"; set output "%s.svg"', name)
png_term = strstrt(GPVAL_TERMINALS, 'pngcairo') > 0 ? 'pngcairo' : 'png'
png_out(name) = sprintf('set terminal %s size 900,520; set output "%s.png"', png_term, name)
do for [k = 1:2] {
  eval(k == 1 ? svg_out('peak_memory') : png_out('peak_memory'))
  set title 'Peak live memory per run'
  set ylabel 'MiB'
  set style data histograms
  set style fill solid 0.8 border -1
  set boxwidth 0.7
  set xtics rotate by -30 noenhanced
  set key off
  set yrange [0:*]
  set grid ytics
  plot 'peak.dat' using 2:xtic(1) linecolor rgb '#4477aa'
}
